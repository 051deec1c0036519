"""NATS and JetStream for every Nodus process."""

from libs.bus.bus import Bus, CallerEndpoint, Endpoint
from libs.bus.connection import DEFAULT_URL, connect, default_url
from libs.bus.epoch_guard import EpochGuard, check_plan_generations
from libs.bus.kv import Bucket, Change, Versioned

__all__ = [
    "DEFAULT_URL",
    "Bucket",
    "Bus",
    "CallerEndpoint",
    "Change",
    "Endpoint",
    "EpochGuard",
    "Versioned",
    "check_plan_generations",
    "connect",
    "default_url",
]
