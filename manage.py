#!/usr/bin/env python
"""Django entry point. platform/ is a source root, not a package (a package named `platform` would shadow the
standard library module that uuid, and so Django, imports), so it goes on the import path here."""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path[:0] = [str(ROOT / "platform"), str(ROOT)]

if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
