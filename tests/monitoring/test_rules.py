"""The alert rules with the real promtool: syntax, unit tests for every alert, and that those tests can fail."""

from __future__ import annotations

import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

from .prom import RULE_TEST_FILES, RULE_TESTS, RULES, alert_rules, binary


def promtool(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([binary("promtool"), *args], capture_output=True, text=True, timeout=120, cwd=cwd)


def test_check_rules():
    proc = promtool("check", "rules", str(RULES))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in proc.stdout


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
    for rule in alert_rules():
        mine = [c for c in cases if c["alertname"] == rule["alert"]]
        assert any(c["exp_alerts"] for c in mine), f"{rule['alert']}: no test where it fires"
        assert any(not c["exp_alerts"] for c in mine), f"{rule['alert']}: no test where it stays silent"


def test_every_alert_tells_what_to_do():
    names = [rule["alert"] for rule in alert_rules()]
    assert len(names) == len(set(names))
    for rule in alert_rules():
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


def cases_of(alert: str, firing: bool | None) -> dict:
    """A promtool test file holding only `alert`'s cases that expect it to fire (True), to stay silent
    (False), or all of them (None)."""
    tests = []
    for path in RULE_TEST_FILES:
        for test in yaml.safe_load(path.read_text())["tests"]:
            cases = [
                case
                for case in test["alert_rule_test"]
                if case["alertname"] == alert and firing in (None, bool(case["exp_alerts"]))
            ]
            if cases:
                tests.append({**test, "alert_rule_test": cases, "promql_expr_test": []})
    return {"rule_files": [f"../{RULES.name}"], "evaluation_interval": "1m", "tests": tests}


def run_cases(workdir: Path, alert: str, firing: bool | None, expr: str | None) -> subprocess.CompletedProcess:
    """promtool on cases_of(alert, firing), with the alert's expression replaced by `expr` (None: as it is)."""
    groups = yaml.safe_load(RULES.read_text())["groups"]
    if expr is not None:
        for group in groups:
            group["rules"] = [{**rule, "expr": expr} if rule.get("alert") == alert else rule for rule in group["rules"]]
    (workdir / "tests").mkdir(parents=True)
    (workdir / RULES.name).write_text(yaml.safe_dump({"groups": groups}))
    cases = workdir / "tests" / "cases.test.yml"
    cases.write_text(yaml.safe_dump(cases_of(alert, firing)))
    return promtool("test", "rules", str(cases))


# An expression that always fires (one series, every evaluation) and one that never does (empty).
ALWAYS, NEVER = "vector(1)", "vector(1) == 0"


def test_each_alerts_cases_fail_when_it_always_or_never_fires(tmp_path):
    """Every alert's silent cases fail once its expression always fires, its firing cases once it never does,
    and all its cases pass alone with the rules as they are: each case looks at that alert's own outcome."""
    assert RULE_TEST_FILES
    runs = [
        (rule["alert"], firing, expr)
        for rule in alert_rules()
        for firing, expr in ((False, ALWAYS), (True, NEVER), (None, None))
    ]
    with ThreadPoolExecutor(4) as pool:  # promtool starts slowly; each run has its own directory
        procs = list(pool.map(lambda i: run_cases(tmp_path / str(i), *runs[i]), range(len(runs))))
    for (alert, firing, expr), proc in zip(runs, procs, strict=True):
        output = proc.stdout + proc.stderr
        if expr is None:
            assert proc.returncode == 0, f"{alert}: its cases fail alone with the rules as they are:\n{output}"
        else:
            kind = "firing" if firing else "silent"
            assert proc.returncode != 0, f"{alert}: its {kind} cases pass with expr {expr!r}:\n{output}"
            assert alert in output
