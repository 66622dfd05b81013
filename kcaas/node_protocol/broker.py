"""The embedded Celery broker of `make up`: kombu's file-system transport, hardened, as the URL `kcaasfs://`.

The control plane (settings.py) and the node agent (gpu_node.agent.process) both import this module, which registers the
`kcaasfs` alias in kombu's transport table; scripts/up.py hands every child `kcaasfs://` (`broker_url()` turns a
`filesystem://` it was given into it: Celery reads the CELERY_BROKER_URL variable before any setting) and the
folders (`folder_options()`). A message is a JSON file `<stamp>_<uuid>.<queue>.msg` in the queue folder, read in
name order (kombu's layout, with a nanosecond stamp where kombu's has milliseconds: kombu's own transport can
share the folder, without these guarantees).

Invariants:
- A message file appears under its `.msg` name only complete: the publisher writes `.<name>.tmp` (a name no
  reader matches), fsyncs it and renames it into place (atomic within one file system).
- A consumer claims a message by renaming it into `<queue folder>/.claimed/` (atomic: exactly one consumer wins),
  then reads it; no reader ever sees a file another reader is consuming.
- A claimed file that is not a kombu message (empty, truncated, not JSON, no delivery tag) never reaches Celery
  and never raises: younger than `undecodable_grace_seconds` (default 10) it goes back for a later poll (a
  publisher that writes in place, as kombu's own does, may still be filling it); older, it is moved into
  `quarantine_folder` (default `<queue folder>/../quarantine`) and logged.
- Message files and exchange tables are created 0600 and the folders this transport makes 0700: only the user
  the platform runs as can read what travels through the broker.
- An exchange table (control folder) is created complete (written aside, then hard-linked into place), so a
  publisher never reads a half-made table; later changes are kombu's, under its file lock.

Not guaranteed: a message a consumer claimed is gone from disk once read (as with kombu's transport): a consumer
killed before it acknowledges loses that message (restored only on a clean shutdown).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
import uuid
from functools import cached_property
from pathlib import Path
from queue import Empty

from kombu.exceptions import ChannelError
from kombu.transport import TRANSPORT_ALIASES, filesystem, virtual
from kombu.utils.encoding import bytes_to_str, str_to_bytes
from kombu.utils.json import dumps, loads

logger = logging.getLogger("kcaas.node_protocol.broker")

SCHEME = "kcaasfs"
URL = f"{SCHEME}://"
TRANSPORT_ALIASES.setdefault(SCHEME, f"{__name__}:Transport")
CLAIM_FOLDER = ".claimed"
DEFAULT_GRACE_SECONDS = 10.0
FILE_MODE, FOLDER_MODE = 0o600, 0o700  # messages and tables are the owner's only (whatever the umask allows more)


def broker_url(url: str) -> str:
    """The broker URL to give Celery: `filesystem://...` becomes `kcaasfs://...`; any other URL is unchanged."""
    scheme, sep, rest = url.partition("://")
    return f"{SCHEME}://{rest}" if sep and scheme == "filesystem" else url


def is_file_broker(url: str) -> bool:
    """Whether `url` names the file-system broker (kombu's or this one): it needs the folder options."""
    return url.partition("://")[0] in ("filesystem", SCHEME)


def folder_options(celery_dir: str | Path) -> dict:
    """The transport options of the embedded broker rooted at `celery_dir` (var/celery): one queue folder read and
    written by every process, exchange tables under control/, nothing kept once consumed."""
    root = Path(celery_dir)
    return {
        "data_folder_in": str(root / "queue"),
        "data_folder_out": str(root / "queue"),
        "processed_folder": str(root / "processed"),
        "control_folder": str(root / "control"),
        "quarantine_folder": str(root / "quarantine"),
        "store_processed": False,
    }


def decoded(raw: bytes) -> dict | None:
    """The kombu message payload in `raw`, or None when it is not one (never raises)."""
    try:
        payload = loads(bytes_to_str(raw))
    except Exception:  # noqa: BLE001 - a stray file must never crash the consumer, whatever the decoder raises
        return None
    properties = payload.get("properties") if isinstance(payload, dict) else None
    if not isinstance(properties, dict) or "delivery_tag" not in properties:
        return None
    return payload


_last_stamp = [0]
_stamp_lock = threading.Lock()


def _stamp() -> str:
    """The sort key of a new message name: the system-wide monotonic clock in ns, zero-padded (names sort as
    numbers), strictly increasing within this process, so one publisher's messages are read in order."""
    with _stamp_lock:
        _last_stamp[0] = max(time.monotonic_ns(), _last_stamp[0] + 1)
        return f"{_last_stamp[0]:020d}"


def _write_json_synced(path: str, content) -> None:
    """Create `path` (it must not exist yet) holding `content` as JSON, fsynced before this returns. Readable by its
    owner only (0600, whatever the umask): a message may carry what only a node should read."""
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE), "wb") as f:
        f.write(str_to_bytes(dumps(content)))
        f.flush()
        os.fsync(f.fileno())


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


class Channel(filesystem.Channel):
    """kombu's file-system channel with atomic publishing, atomic claims and tolerant reads (module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for folder in (self.data_folder_in, self.data_folder_out, self.control_folder, self.claim_folder):
            os.makedirs(folder, mode=FOLDER_MODE, exist_ok=True)

    @cached_property
    def claim_folder(self) -> str:
        return os.path.join(self.data_folder_in, CLAIM_FOLDER)

    @cached_property
    def quarantine_folder(self) -> str:
        default = os.path.join(os.path.dirname(os.path.abspath(self.data_folder_in)), "quarantine")
        return self.transport_options.get("quarantine_folder") or default

    @cached_property
    def undecodable_grace_seconds(self) -> float:
        return float(self.transport_options.get("undecodable_grace_seconds", DEFAULT_GRACE_SECONDS))

    def _put(self, queue, payload, **kwargs):
        """Publish: write a hidden temporary file, fsync it, rename it to its message name."""
        name = f"{_stamp()}_{uuid.uuid4()}.{queue}.msg"
        final = os.path.join(self.data_folder_out, name)
        temporary = os.path.join(self.data_folder_out, f".{name}.tmp")
        try:
            _write_json_synced(temporary, payload)
            os.rename(temporary, final)
        except OSError as exc:
            _unlink_quietly(temporary)
            raise ChannelError(f"Cannot add file {final!r} to directory") from exc

    def _get(self, queue):
        """The oldest message of `queue` that decodes; files that do not are set aside, never raised."""
        suffix = f"{queue}.msg"
        for name in sorted(os.listdir(self.data_folder_in)):
            if name.partition(".")[2] == suffix:
                payload = self._take(name)
                if payload is not None:
                    return payload
        raise Empty()

    def _take(self, name: str) -> dict | None:
        """Claim `name`, read it, and return its payload; None when another consumer claimed it first or it is not
        a message (then set aside: `_set_aside`)."""
        source, claimed = os.path.join(self.data_folder_in, name), os.path.join(self.claim_folder, name)
        try:
            os.rename(source, claimed)
        except OSError:
            return None  # another consumer won it (or it vanished)
        try:
            with open(claimed, "rb") as f:
                raw, age = f.read(), time.time() - os.fstat(f.fileno()).st_mtime
        except OSError as exc:
            raise ChannelError(f"Cannot read file {claimed!r} from queue.") from exc
        payload = decoded(raw)
        if payload is None:
            self._set_aside(claimed, source, age, len(raw))
        elif self.store_processed:
            shutil.move(claimed, os.path.join(self.processed_folder, name))
        else:
            os.unlink(claimed)
        return payload

    def _set_aside(self, claimed: str, source: str, age: float, size: int) -> None:
        """A young undecodable file goes back to the queue folder (it may still be written); an old one goes to the
        quarantine folder, logged."""
        try:
            if age < self.undecodable_grace_seconds:
                os.rename(claimed, source)
                return
            os.makedirs(self.quarantine_folder, mode=FOLDER_MODE, exist_ok=True)
            target = shutil.move(claimed, os.path.join(self.quarantine_folder, os.path.basename(claimed)))
        except OSError:
            logger.exception("kcaasfs: could not set aside the undecodable file %s", claimed)
            return
        logger.warning("kcaasfs: %s is not a message (%d bytes, %.0f s old): moved to %s", source, size, age, target)

    def _queue_bind(self, exchange, routing_key, pattern, queue):
        """Bind as kombu does, but create a missing exchange table complete (link of a finished file)."""
        table = self._exchange_file(exchange)
        if not table.exists():
            entry = filesystem.exchange_queue_t(routing_key or "", pattern or "", queue or "")
            self._create_table(table, [entry])
        super()._queue_bind(exchange, routing_key, pattern, queue)

    def _create_table(self, table: Path, entries: list) -> None:
        os.makedirs(table.parent, mode=FOLDER_MODE, exist_ok=True)
        temporary = str(table.parent / f".{table.name}.{uuid.uuid4()}.tmp")
        try:
            _write_json_synced(temporary, entries)
            os.link(temporary, table)
        except FileExistsError:
            pass  # another process made it first; kombu adds our entry under its lock
        except OSError as exc:
            raise ChannelError(f"Cannot create {table}") from exc
        finally:
            _unlink_quietly(temporary)


_states: dict[str, virtual.BrokerState] = {}
_states_lock = threading.Lock()


class Transport(filesystem.Transport):
    """The `kcaasfs://` transport: kombu's file-system transport with the Channel above.

    Its in-memory broker state (declared exchanges and bindings, which let kombu skip re-binding) is one per control
    folder, not one per process as kombu's: a binding this process remembers is one written in that folder."""

    Channel = Channel
    driver_type = "filesystem"
    driver_name = SCHEME

    @property
    def default_connection_params(self) -> dict:
        """None: a folder has no host. (kombu's virtual transports default to `localhost` and log a warning, "No
        hostname was supplied", on every connection of every process whose URL, like `kcaasfs://`, names none.)"""
        return {}

    def __init__(self, client, **kwargs):
        super().__init__(client, **kwargs)
        folder = os.path.abspath(client.transport_options.get("control_folder", "control"))
        with _states_lock:
            self.state = _states.setdefault(folder, virtual.BrokerState())
