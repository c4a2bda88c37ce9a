"""kaisa_jax: distributed K-FAC (KAISA) for JAX, Flax and Optax.

The public API::

  grad_fn = kaisa_jax.value_and_grad(loss_fn)          # capture
  layers = grad_fn.layers(params, batch)               # what gets preconditioned
  tx = optax.chain(kaisa_jax.kfac(layers, lr=0.1), optax.sgd(0.1, momentum=0.9))
  loss, grads, curvature = grad_fn(params, batch)
  updates, opt_state = tx.update(grads, opt_state, params, curvature=curvature)
"""

from kaisa_jax.capture import LayerCurvature, Layers, ValueAndGrad, value_and_grad
from kaisa_jax.transform import KFAC, KFACState, Plan, kfac

__all__ = [
  "KFAC",
  "KFACState",
  "LayerCurvature",
  "Layers",
  "Plan",
  "ValueAndGrad",
  "kfac",
  "value_and_grad",
]
__version__ = "0.1.0"
