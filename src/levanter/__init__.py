"""levanter: step-ordered language-model training on JAX, Equinox and Haliax.

Step ``s`` of a run reads exactly the global indices its batch schedule assigns to it, and every
dataset is told the step it is serving. See ``docs/design/data-order.md``.
"""

# The parts are imported by name (``levanter.training``, ``levanter.data``...), not re-exported here:
# importing ``levanter`` must not import JAX.
__all__ = ["__version__"]

__version__ = "0.1.0"

