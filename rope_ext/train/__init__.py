"""Training helpers for context extension (on top of peft and accelerate; never a copy of them)."""

from rope_ext.train.pose import pose_batch, pose_position_ids

__all__ = ["pose_batch", "pose_position_ids"]
