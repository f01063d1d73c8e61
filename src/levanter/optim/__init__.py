from .config import AdamConfig, OptimizerConfig, lr_schedule_fn

__all__ = ["AdamConfig", "OptimizerConfig", "lr_schedule_fn"]
