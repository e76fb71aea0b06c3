"""Where a benchmark result came from: the commit and the host, recorded beside the figures."""

from __future__ import annotations

import platform
import subprocess

import torch


def commit() -> str:
    """The short hash of HEAD (``"unknown"`` outside a git checkout)."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return out.stdout.strip()


def host() -> str:
    """``"x86_64 2 threads, torch 2.13.0+cpu"``."""
    return f"{platform.processor() or platform.machine()} {torch.get_num_threads()} threads, torch {torch.__version__}"
