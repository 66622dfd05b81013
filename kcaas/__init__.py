"""KCaaS tenant SDK (REST and data-plane clients arrive with the node agent issue)."""
