"""Monitoring: progress display and metric records."""

from .metrics import MetricsWriter, read_metrics
from .progress import ProgressBar, format_duration

__all__ = ["MetricsWriter", "ProgressBar", "format_duration", "read_metrics"]
