"""`python -m gpu_node.agent`: the node agent process (gpu_node/agent/process.py), started clean.

Before any library loads (this module imports only the standard library until the agent itself):
- on Linux, re-execute once with LD_BIND_NOW=1 (one interpreter start). Lazy symbol binding saves every vector
  register on the calling thread's stack (_dl_runtime_resolve_xsave) the first time a library function is called,
  and registers still hold the last bytes a copy or a cipher moved: a tenant's KV would stay in that stack after
  its erasure;
- drop PROMETHEUS_MULTIPROC_DIR: the agent serves its own registry, and prometheus_client's multiprocess mode (meant
  for the control plane's processes, inherited under `make up`) would also put its series in the control plane's
  /metrics.
"""

import os
import sys

if sys.platform.startswith("linux") and not os.environ.get("LD_BIND_NOW"):
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], {**os.environ, "LD_BIND_NOW": "1"})
os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)

from gpu_node.agent.process import main

raise SystemExit(main())
