"""The trainer's one error type."""


class TrainingError(RuntimeError):
    """A configuration, data or numerical problem found before or during training (the message says what to do)."""
