"""Tracing in one place: the per-rank Chrome-trace recorder, its merger, and per-layer module hooks."""

from .module_hooks import instrument
from .timeline import Timeline, TimelineError, merge, span_of, summarize

__all__ = ["Timeline", "TimelineError", "instrument", "merge", "span_of", "summarize"]
