"""What the training loop checks a step against besides finiteness: the loss-spike
guard (``train.spike_factor``). A step whose finite loss exceeds the factor times the
median loss of the last ``train.spike_window`` steps that updated the state is handled
as a non-finite one: the runtime updates nothing (the limit goes into its step, like
the finiteness check) and ``train.on_nonfinite`` skips, rolls back or stops."""

from __future__ import annotations

import collections
import math

import numpy as np


class SpikeGuard:
    """The running median of the last ``window`` losses of steps that updated the state
    (spikes and non-finite steps are not added), and the limit it gives the next step:
    ``factor`` times that median, or infinity while the window is not full or with
    ``factor`` 0 (off)."""

    def __init__(self, factor: float, window: int):
        self.factor = factor
        self.losses: collections.deque[float] = collections.deque(maxlen=window)
        self.spikes = 0  # steps held back as spikes so far

    def limit(self) -> float:
        """The loss above which the next step is a spike."""
        if not self.factor or len(self.losses) < self.losses.maxlen:
            return math.inf
        return self.factor * self.median()

    def median(self) -> float:
        return float(np.median(self.losses))

    def add(self, loss: float) -> None:
        """A step that updated the state, with its loss."""
        self.losses.append(loss)
