"""The alert rules with the real promtool: syntax, unit tests for every alert, and that those tests can fail."""

from __future__ import annotations

import re
import shutil
import subprocess

import yaml

from .prom import RULE_TESTS, RULES, binary

RULE_TEST_FILES = (RULE_TESTS, RULE_TESTS.parent / "auth-alerts.test.yml")  # the API key alert has a file of its own


def promtool(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([binary("promtool"), *args], capture_output=True, text=True, timeout=120, cwd=cwd)


def alerts() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"] if "alert" in rule]


def test_check_rules():
    proc = promtool("check", "rules", str(RULES))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(alerts())} rules found" in proc.stdout


def test_unit_tests_pass():
    proc = promtool("test", "rules", *map(str, RULE_TEST_FILES))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("SUCCESS") == len(RULE_TEST_FILES)


def test_every_alert_is_tested_firing_and_silent():
    cases = [
        case
        for path in RULE_TEST_FILES
        for test in yaml.safe_load(path.read_text())["tests"]
        for case in test["alert_rule_test"]
    ]
    for rule in alerts():
        mine = [c for c in cases if c["alertname"] == rule["alert"]]
        assert any(c["exp_alerts"] for c in mine), f"{rule['alert']}: no test where it fires"
        assert any(not c["exp_alerts"] for c in mine), f"{rule['alert']}: no test where it stays silent"


def test_every_alert_tells_what_to_do():
    names = [rule["alert"] for rule in alerts()]
    assert len(names) == len(set(names))
    for rule in alerts():
        assert rule["labels"]["severity"] in ("critical", "warning"), rule["alert"]
        assert set(rule["annotations"]) >= {"summary", "description", "action"}, rule["alert"]


def test_unit_tests_catch_a_changed_threshold(tmp_path):
    """The unit tests are not vacuous: loosen one threshold and they fail."""
    (tmp_path / "tests").mkdir()
    shutil.copy(RULE_TESTS, tmp_path / "tests" / RULE_TESTS.name)
    text = RULES.read_text()
    loosened, count = re.subn(r"\) > 0\.05\n", ") > 0.5\n", text)
    assert count == 1, "the error-ratio threshold moved; update this test"
    (tmp_path / RULES.name).write_text(loosened)
    proc = promtool("test", "rules", str(tmp_path / "tests" / RULE_TESTS.name))
    assert proc.returncode != 0
    assert "OpenEngineErrorRatioHigh" in proc.stdout + proc.stderr
