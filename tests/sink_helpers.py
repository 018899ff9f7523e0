"""A sink for tests: records the step and the summary of every window it is handed."""


class StepSink:
    """Records ``(trace.step, telemetry)`` of every window (a real :class:`tl_dist.Sink`)."""

    def __init__(self):
        self.windows = []

    def on_window(self, trace, telemetry):
        self.windows.append((trace.step, telemetry))

    def close(self):
        pass
