"""gpu_node.dataplane.tokens.RevocationList: a revoked jti stays refused until its token has expired, then leaves."""

from gpu_node.dataplane.tokens import RevocationList


class Clock:
    def __init__(self, now: float = 1_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_listed_until_expiry_plus_leeway_then_pruned():
    clock = Clock()
    revoked = RevocationList(leeway=5.0, clock=clock)
    revoked.add("j1", clock.now + 100)
    revoked.add("j2", clock.now + 1000)
    assert "j1" in revoked and "j2" in revoked and "j3" not in revoked
    clock.now += 104  # j1 could still pass with the leeway
    assert "j1" in revoked
    clock.now += 61  # past exp + leeway, and the once-a-minute prune is due
    assert "j1" not in revoked and "j2" in revoked
    assert len(revoked) == 1


def test_update_takes_control_plane_entries_and_skips_malformed_ones():
    clock = Clock()
    revoked = RevocationList(clock=clock)
    count = revoked.update(
        [
            {"jti": "a", "exp": clock.now + 60},
            {"jti": "b"},
            {"exp": 5},
            "junk",
            {"jti": ""},
            {"jti": "c", "exp": "not a number"},
        ]
    )
    assert count == 3
    assert all(jti in revoked for jti in ("a", "b", "c"))
    clock.now += 3600  # "a" expired; unknown exps are kept a day
    assert "a" not in revoked and "b" in revoked and "c" in revoked


def test_a_later_expiry_for_the_same_jti_wins():
    clock = Clock()
    revoked = RevocationList(leeway=0, clock=clock)
    revoked.add("j", clock.now + 10)
    revoked.add("j", clock.now + 500)
    revoked.add("j", clock.now + 20)
    clock.now += 200
    assert "j" in revoked
