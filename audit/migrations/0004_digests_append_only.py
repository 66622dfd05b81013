"""Signed digests are append-only in PostgreSQL too: a row trigger refuses UPDATE and DELETE, a statement trigger
refuses TRUNCATE (except under `kcaas.audit_allow_truncate = on`, the test suite's flush), and UPDATE/DELETE/TRUNCATE
are revoked from PUBLIC. A digest is never corrected: a wrong one stays, and verification names it."""

from django.db import migrations

FUNCTION = """
CREATE OR REPLACE FUNCTION audit_digest_guard() RETURNS trigger AS $$
BEGIN
    IF TG_OP = 'TRUNCATE' AND current_setting('kcaas.audit_allow_truncate', true) = 'on' THEN
        RETURN NULL;
    END IF;
    RAISE EXCEPTION 'audit digests are append-only: % refused', TG_OP USING ERRCODE = 'insufficient_privilege';
END
$$ LANGUAGE plpgsql;
"""
CREATE = """
CREATE TRIGGER audit_digest_append_only BEFORE UPDATE OR DELETE ON audit_auditdigest
    FOR EACH ROW EXECUTE FUNCTION audit_digest_guard();
CREATE TRIGGER audit_digest_no_truncate BEFORE TRUNCATE ON audit_auditdigest
    FOR EACH STATEMENT EXECUTE FUNCTION audit_digest_guard();
REVOKE UPDATE, DELETE, TRUNCATE ON audit_auditdigest FROM PUBLIC;
"""
DROP = """
DROP TRIGGER IF EXISTS audit_digest_no_truncate ON audit_auditdigest;
DROP TRIGGER IF EXISTS audit_digest_append_only ON audit_auditdigest;
DROP FUNCTION IF EXISTS audit_digest_guard();
"""


def install(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(FUNCTION, params=None)
        schema_editor.execute(CREATE, params=None)


def uninstall(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(DROP, params=None)


class Migration(migrations.Migration):
    dependencies = [("audit", "0003_digests")]
    operations = [migrations.RunPython(install, uninstall)]
