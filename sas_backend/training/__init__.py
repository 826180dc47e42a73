"""Gate training for SAS (frozen backbone, trainable gates)."""
