"""kaisa_jax: distributed K-FAC (KAISA) for JAX, Flax and Optax.

The public API::

  grad_fn = kaisa_jax.value_and_grad(loss_fn)          # capture
  layers = grad_fn.layers(params, batch)               # what gets preconditioned
  tx = optax.chain(kaisa_jax.kfac(layers, lr=0.1), optax.sgd(0.1, momentum=0.9))
  loss, grads, curvature = grad_fn(params, batch)
  updates, opt_state = tx.update(grads, opt_state, params, curvature=curvature)

Distributed: ``mesh = kaisa_jax.make_mesh("hybrid_opt")`` and
``kaisa_jax.kfac(layers, mesh=mesh, ...)`` under ``jax.shard_map``, or
``kaisa_jax.kfac(layers, axis_name="batch", grad_worker_fraction=...)`` under
``jax.pmap``. Which fraction: ``print(kaisa_jax.plan_fractions(layers, n,
kaisa_jax.DGX_A100))``. A custom layer: ``kaisa_jax.register_layer(MyLayer, weight="w")``.
Tools that measure and project a compiled step (HLO costs, collectives, host
probes) are in `kaisa_jax.analysis`, which ``import kaisa_jax`` does not load.
What the preconditioner sees, per layer (eigenvalues, relative damping, condition
number) and K-FAC's health counters: ``kaisa_jax.curvature_statistics(kfac, opt_state)``.
"""

from kaisa_jax import statistics
from kaisa_jax.capture import LayerCurvature, Layers, ValueAndGrad, value_and_grad
from kaisa_jax.checkpointing import PortableKFACState, from_portable, to_portable
from kaisa_jax.cluster import DGX_A100, DGX_H100, DGX_H200, Cluster
from kaisa_jax.distribution import GRAD_WORKERS, RECEIVERS, make_mesh
from kaisa_jax.layers import register_layer
from kaisa_jax.planning import FractionPlan, plan_fractions
from kaisa_jax.statistics import CurvatureStatistics, check_damping, curvature_statistics
from kaisa_jax.transform import (
  KFAC,
  KFACState,
  Plan,
  kfac,
  layer_decompositions,
  layer_factors,
  partition_specs,
)

__all__ = [
  "DGX_A100",
  "DGX_H100",
  "DGX_H200",
  "GRAD_WORKERS",
  "KFAC",
  "RECEIVERS",
  "Cluster",
  "CurvatureStatistics",
  "FractionPlan",
  "KFACState",
  "LayerCurvature",
  "Layers",
  "Plan",
  "PortableKFACState",
  "ValueAndGrad",
  "check_damping",
  "curvature_statistics",
  "from_portable",
  "kfac",
  "layer_decompositions",
  "layer_factors",
  "make_mesh",
  "partition_specs",
  "plan_fractions",
  "register_layer",
  "statistics",
  "to_portable",
  "value_and_grad",
]
__version__ = "0.1.0"
