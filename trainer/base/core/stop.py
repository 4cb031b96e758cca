"""The exception a long start-up phase raises when a stop signal arrived (trainer/run/signals.py):
a module of its own, importing nothing, so that the collectives (comm/base.py root_decides,
all_succeed) can carry it to every rank without an import cycle through core/errors.py."""
from __future__ import annotations


class StopRequested(Exception):
    """A stop signal ended start-up in a long phase (its name is the message: "placement
    profiling", "the resume's load"); nothing was trained, so nothing is saved."""
