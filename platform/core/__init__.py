"""The ground floor of the control plane: what every room may import and which imports no room.

- `core.errors`: the one error shape, the application errors (refusals a client can act on, and `TransientError`
  for "nothing was changed, retry"), the DRF exception handler and handler500, outages as 503;
- `core.transient`: which exceptions count as a database or broker outage, and the retry policy of node answers;
- `core.query_parameters`: undeclared query parameters refused from the published schema;
- `core.celery`: the Celery app (tasks to a node go to its own queue);
- `core.openapi`, `core.permissions`, `core.pagination`: shared DRF plumbing (the error responses of the schema,
  scope and staff permissions, bounded pagination);
- `core.ids`, `core.keys`: id parsing, and the key/credential format (`kc_<kind>_<public_id>_<secret><crc>`) with
  its peppered hashing, for tenants' API keys and nodes' credentials alike.

Layering: core <- audit <- tenants <- fleet <- caches <- billing <- privacy <- console, and `controlplane` (settings,
urls, wsgi, authentication wiring) is the roof that imports them all and that nothing imports
(`tests/controlplane/test_layering.py` enforces it).
"""
