"""A KCaaSConnector that breaks its own promise, for tests/e2e/test_vllm_faults.py (loaded by vLLM through
kv_connector_module_path "tests.e2e.vllm_faulty_connector"; the main venv never imports it).

`get_num_new_matched_tokens` asks the real connector, and when it promised tokens, deletes the request's prompt
from the cache on the node (DataPlaneClient.delete with its own readwrite token) before vLLM loads: the load that
follows finds nothing, and vLLM must recompute what was promised. Every deletion is logged to stderr as
"vllm_faulty_connector: deleted ..." so a test can tell that the fault happened.
"""

from __future__ import annotations

import os
import ssl
import sys

import numpy as np

import kcaas
from kcaas.connectors.vllm import KCaaSConnector
from kcaas.dataplane import DataPlaneClient
from kcaas.tokens import TokenSource


class DeletingKCaaSConnector(KCaaSConnector):
    _deleter: DataPlaneClient | None = None

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        promised, load_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if promised:
            removed = self._node().delete(np.asarray(request.prompt_token_ids, dtype=np.int32))
            print(
                f"vllm_faulty_connector: deleted {removed} blocks of request {request.request_id} after promising "
                f"{promised} tokens",
                file=sys.stderr,
                flush=True,
            )
        return promised, load_async

    def _node(self) -> DataPlaneClient:
        """Its own client of the cache (from the same extra config), with a readwrite token."""
        if self._deleter is None:
            extra = self._kv_transfer_config.kv_connector_extra_config
            client = kcaas.Client(extra["kcaas_url"], os.environ[extra.get("api_key_env") or "KCAAS_API_KEY"])
            cache = next(c for c in client.list_caches(state="ready") if extra["cache"] in (c.id, c.name))
            tls = ssl.create_default_context(cafile=extra["ca_file"])
            self._deleter = DataPlaneClient(
                cache.endpoint,
                TokenSource(client, cache.id, "readwrite"),
                cache.id,
                cache.spec,
                ssl_context=tls,
                timeout=10.0,
            )
        return self._deleter
