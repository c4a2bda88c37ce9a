"""One process of a multi-process run: ``python multiprocess_worker.py ID COUNT PORT OUT``.

Each process has 4 CPU devices; together they form one mesh over which the MLP
is trained with K-FAC under ``jax.shard_map``. Process 0 writes the final
parameters of each grad worker fraction to ``OUT`` (npz).
"""

import os
import sys

process_id, processes, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
os.environ["XLA_FLAGS"] = (
  "--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0"
)

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=processes, process_id=process_id)

import numpy as np  # noqa: E402
from distributed_setup import run  # noqa: E402

results = {}
for fraction in ("1/8", "1/2"):
  _, params, _ = run("mlp", "shard_map", jax.device_count(), fraction, 5, chained=True)
  for i, leaf in enumerate(jax.tree.leaves(params)):
    results[f"{fraction}/{i}"] = leaf
if process_id == 0:
  np.savez(out, **results)
jax.distributed.shutdown()
