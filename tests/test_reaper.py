"""Processes plugin code starts in the harness's own process (import, availability(), --no-isolate) or that leave
their worker's group do not outlive ``mha-harness`` nor hold its stdout open (mha_harness.util.reaper)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid

from tests.conftest import ROOT, run_cli
from tests.probes.issue13 import marked_processes


def test_a_child_started_by_a_plugin_import_in_the_harness_is_killed_when_the_command_ends():
    mark = f"mha-reaper-test-{uuid.uuid4().hex}"
    # capture_output waits for EOF on stdout: a child still holding it would make this time out
    out = run_cli("list", "--backend-spec", "tests.hostile_import_child:Backend", env={"MHA_HOSTILE_MARK": mark},
                  timeout=180)
    try:
        assert out.returncode == 0, out.stderr
        assert "hostile-child-at-import" in out.stdout
        assert "killed 1 process(es) that plugin code started" in out.stderr
        assert marked_processes(mark) == []
    finally:
        for pid in marked_processes(mark):
            os.kill(pid, 9)


def test_kill_leftovers_reaches_a_setsid_grandchild_whose_parent_died():
    """A worker's child that calls setsid leaves the group the worker kill covers; as subreaper the harness
    inherits it when its parent dies and kills it at the end."""
    mark = f"mha-reaper-test-{uuid.uuid4().hex}"
    script = textwrap.dedent(f"""
        import os, subprocess, sys, time
        from mha_harness.util import reaper
        assert reaper.become_subreaper()
        middle = subprocess.Popen([sys.executable, "-c",
            "import subprocess, sys; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)', "
            "'{mark}'], start_new_session=True)"])
        middle.wait()
        time.sleep(0.5)
        killed = reaper.kill_leftovers()
        print(len(killed))
    """)
    try:
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "1"
        assert marked_processes(mark) == []
    finally:
        for pid in marked_processes(mark):
            os.kill(pid, 9)


def test_main_with_argv_leaves_the_callers_children_alone():
    from mha_harness import cli
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert cli.main(["check", "--jobs", "0"]) == 2
        assert child.poll() is None
    finally:
        child.kill()
        child.wait()


def test_a_clean_check_reports_no_leftover_the_harness_itself_started(tmp_path):
    """The fork server the isolated workers start from (and multiprocessing's resource tracker) are the harness's
    own: a check of a built-in backend must not blame plugin code for them, and they end with the command."""
    out = run_cli("check", "--backend", "numpy-naive", "--case", "check_scores_scaled_by_sqrt_d_head", "--results",
                  tmp_path, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "process(es) that plugin code started" not in out.stderr, out.stderr
