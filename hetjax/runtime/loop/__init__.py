"""The per-layer loop: the schedule, block kinds, prefetch window, boundaries, gradients."""
