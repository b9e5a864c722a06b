"""servescope.scheduler: continuous batching, chunked prefill, preemption (pure Python)."""

from servescope.scheduler.output import ScheduledSequence, SchedulerOutput
from servescope.scheduler.request import Request, RequestStatus
from servescope.scheduler.scheduler import Scheduler

__all__ = ["Request", "RequestStatus", "ScheduledSequence", "SchedulerOutput", "Scheduler"]
