"""Monitoring: progress display and metric records."""

from .metrics import MetricsWriter, read_metrics
from .progress import ProgressBar, format_duration
from .record import MetricsRecord

__all__ = ["MetricsRecord", "MetricsWriter", "ProgressBar", "format_duration",
           "read_metrics"]
