"""The audit table is append-only in the database itself (PostgreSQL): a row trigger refuses UPDATE and DELETE, a
statement trigger refuses TRUNCATE, and UPDATE/DELETE/TRUNCATE are revoked from PUBLIC (the app's role, when it is
not the table owner, holds only SELECT and INSERT).

Two narrow exceptions, each switched on by a setting of the session, never by default:
- `kcaas.audit_pseudonymise = on` (audit.services.audit_pseudonymise_tenant, in its own transaction): an UPDATE
  that keeps every hashed field (seq, hash, prev_hash, commitments, occurred_at, action, actor_kind, target_type,
  request_id) and changes only personal fields / the salt;
- `kcaas.audit_allow_truncate = on`: TRUNCATE, which only the test suite's database flush sets (tests/conftest.py).

A superuser can still disable the triggers; audit_verify then finds what was changed.
"""

from django.db import migrations

FUNCTION = """
CREATE OR REPLACE FUNCTION audit_event_guard() RETURNS trigger AS $$
BEGIN
    IF TG_OP = 'TRUNCATE' AND current_setting('kcaas.audit_allow_truncate', true) = 'on' THEN
        RETURN NULL;
    END IF;
    IF TG_OP = 'UPDATE' AND current_setting('kcaas.audit_pseudonymise', true) = 'on'
       AND NEW.seq = OLD.seq AND NEW.hash = OLD.hash AND NEW.prev_hash = OLD.prev_hash
       AND NEW.commitments = OLD.commitments AND NEW.occurred_at = OLD.occurred_at AND NEW.action = OLD.action
       AND NEW.actor_kind = OLD.actor_kind AND NEW.target_type = OLD.target_type
       AND NEW.request_id = OLD.request_id THEN
        RETURN NEW;
    END IF;
    RAISE EXCEPTION 'audit events are append-only: % refused', TG_OP USING ERRCODE = 'insufficient_privilege';
END
$$ LANGUAGE plpgsql;
"""
CREATE = """
CREATE TRIGGER audit_event_append_only BEFORE UPDATE OR DELETE ON audit_auditevent
    FOR EACH ROW EXECUTE FUNCTION audit_event_guard();
CREATE TRIGGER audit_event_no_truncate BEFORE TRUNCATE ON audit_auditevent
    FOR EACH STATEMENT EXECUTE FUNCTION audit_event_guard();
REVOKE UPDATE, DELETE, TRUNCATE ON audit_auditevent FROM PUBLIC;
"""
DROP = """
DROP TRIGGER IF EXISTS audit_event_no_truncate ON audit_auditevent;
DROP TRIGGER IF EXISTS audit_event_append_only ON audit_auditevent;
DROP FUNCTION IF EXISTS audit_event_guard();
"""


def install(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(FUNCTION, params=None)
        schema_editor.execute(CREATE, params=None)


def uninstall(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(DROP, params=None)


class Migration(migrations.Migration):
    dependencies = [("audit", "0001_initial")]
    operations = [migrations.RunPython(install, uninstall)]
