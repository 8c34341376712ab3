"""deploy/prometheus and deploy/grafana against a real Prometheus and a running ``hsx run``.

Debian's Prometheus (``bash .ci/ops-env``) checks the scrape config and the alert rules
(``promtool check``, ``promtool test rules``); then a Prometheus on 127.0.0.1 scrapes a
real ``hsx run`` (against ``hsx fake-server``, with bad input lines and injected HTTP 500s
so that every labelled series exists; the server is stopped at the end, for the eviction
counter) and every hsx metric, every dashboard query and every alert rule is asked for
through its HTTP API. Grafana has no server package here:
its dashboard JSON is checked structurally and its PromQL (variables substituted as
Grafana would) by ``promtool`` and the live Prometheus.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.core import Metric

from hsx_async.run.daemon.status import RunStatus, StatusCollector
from hsx_async.run.pipeline.metrics import Metrics
from hsx_async.run.servers.faults import KINDS
from tests.deploy.realenv import http_get, process, require_tools, stop, wait_for
from tests.e2e import config_raw, free_port, write_config, write_samples

pytestmark = pytest.mark.prometheus

REPO = Path(__file__).resolve().parents[2]
PROM_DIR = REPO / "deploy" / "prometheus"
PROM_CONFIG = PROM_DIR / "prometheus.yml"
RULES = PROM_DIR / "hsx-alerts.yml"
RULE_TESTS = PROM_DIR / "tests" / "hsx-alerts.test.yml"
DASHBOARD = REPO / "deploy" / "grafana" / "hsx-dashboard.json"
SCRAPE_S = 1
# What Grafana puts for its variables with a 1 s scrape interval: $__rate_interval is
# max($__interval + scrape interval, 4 × scrape interval).
GRAFANA_VARS = {
    "$__rate_interval": "5s",
    "$__interval": "1s",
    "$__range": "1m",
    "$job": "hsx",
    "$instance": ".*",
}
H, AUX = 64, (1, 3, 5)
# Series that exist only once a server has left rotation: the live test takes its server
# away for them, after the checks of a healthy run.
ON_EVICTION = frozenset({"hsx_server_out_of_rotation_total"})
Proc = subprocess.Popen[bytes]


def _promtool(*args: str, cwd: Path = PROM_DIR) -> str:
    tool = require_tools("promtool")["promtool"]
    done = subprocess.run(
        [tool, *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, f"promtool {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def _targets(dash: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, PromQL with Grafana's variables substituted) for every target."""
    out = []
    for panel in dash["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            for var, value in sorted(GRAFANA_VARS.items(), key=lambda kv: -len(kv[0])):
                expr = expr.replace(var, value)
            assert "$" not in expr, f"{panel['title']}: unknown variable in {expr}"
            out.append((panel["title"], expr))
    return out


def _no_snapshot() -> RunStatus:
    raise AssertionError("describe() needs no snapshot")


def _exposed_series() -> dict[str, Metric]:
    """Every series name hsx exposes (counters as *_total, histograms as _bucket/_sum/
    _count), from a fresh registry and the run's status collector (the gauges)."""
    names: dict[str, Metric] = {}
    families = [*Metrics().registry.collect(), *StatusCollector(_no_snapshot).describe()]
    for family in families:
        if family.type == "counter":
            names[f"{family.name}_total"] = family
        elif family.type == "histogram":
            for suffix in ("_bucket", "_sum", "_count"):
                names[family.name + suffix] = family
        else:
            names[family.name] = family
    return names


def _hsx_names(text: str) -> set[str]:
    return set(re.findall(r"\bhsx_[a-z_]+\b", text)) - {"hsx_job"}


def _names_in(path: Path) -> set[str]:
    """The hsx series (or family) names a rules file mentions outside comments, or the
    dashboard in its queries."""
    if path.suffix == ".json":
        text = "\n".join(
            t["expr"] for p in json.loads(path.read_text())["panels"] for t in p["targets"]
        )
    else:
        text = "\n".join(
            ln for ln in path.read_text().splitlines() if not ln.lstrip().startswith("#")
        )
    return _hsx_names(text)


# --- static: promtool and the dashboard's structure ----------------------------------


def test_promtool_checks_config_and_rules() -> None:
    out = _promtool("check", "config", str(PROM_CONFIG))
    assert "1 rule files found" in out
    out = _promtool("check", "rules", str(RULES))
    assert "7 rules found" in out


def test_alert_rules_fire_as_their_unit_tests_say() -> None:
    out = _promtool("test", "rules", RULE_TESTS.name, cwd=RULE_TESTS.parent)
    assert "SUCCESS" in out
    tested = set(re.findall(r"alertname: (\w+)", RULE_TESTS.read_text()))
    defined = {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}
    assert defined == tested, f"alerts without a unit test: {sorted(defined - tested)}"


def test_rules_and_dashboard_name_only_metrics_hsx_exposes() -> None:
    exposed = _exposed_series()
    known = {*exposed, *(family.name for family in exposed.values())}
    for path in (RULES, DASHBOARD, RULE_TESTS):
        unknown = _names_in(path) - known
        assert not unknown, f"{path.name} names series hsx does not export: {sorted(unknown)}"
    # ... and the dashboard shows every one of them.
    shown = _names_in(DASHBOARD)
    missing = {name for name in exposed if name not in shown}
    assert not missing, f"the dashboard has no panel for {sorted(missing)}"


def test_dashboard_structure() -> None:
    dash = _dashboard()
    assert dash["uid"] and dash["title"] and isinstance(dash["schemaVersion"], int)
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    for panel in dash["panels"]:
        assert panel["type"] in {"timeseries", "stat"}, panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target["expr"].strip() and target["datasource"]["uid"] == "${datasource}"
            used = set(re.findall(r"\$\w+", target["expr"]))
            assert used <= {*GRAFANA_VARS, *(f"${name}" for name in variables)}, used


def test_dashboard_queries_are_valid_promql(tmp_path: Path) -> None:
    """Every query, as recording rules, passes ``promtool check rules``."""
    rules = [
        {"record": f"hsx_dashboard:query_{i}", "expr": expr}
        for i, (_, expr) in enumerate(_targets(_dashboard()))
    ]
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    assert f"{len(rules)} rules found" in _promtool("check", "rules", str(path))


# --- live: a real Prometheus scraping a running hsx ----------------------------------


@dataclass
class Live:
    prometheus: str  # base URL
    hsx: subprocess.Popen[bytes]
    server: subprocess.Popen[bytes]
    tmp: Path

    def query(self, expr: str) -> list[dict[str, Any]]:
        url = f"{self.prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        reply = json.loads(http_get(url))
        assert reply["status"] == "success", (expr, reply)
        result: list[dict[str, Any]] = reply["data"]["result"]
        return result

    def api(self, path: str) -> Any:
        reply = json.loads(http_get(f"{self.prometheus}/api/v1/{path}"))
        assert reply["status"] == "success", reply
        return reply["data"]


def _fake_server(stack: contextlib.ExitStack, tmp: Path, shm_root: Path) -> tuple[Proc, str]:
    argv = [
        sys.executable, "-m", "hsx_async", "fake-server", "--port", "0",
        "--hidden-size", str(H), "--aux-layers", ",".join(map(str, AUX)),
        "--dump-root", str(shm_root), "--latency-base-ms", "100",
        "--fault-rate", "0.05", "--faults", "http_500",
    ]  # fmt: skip
    log = tmp / "fake-server.log"
    proc = stack.enter_context(process(argv, log))

    def url() -> str | None:
        m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", log.read_text())
        return m.group(1) if m else None

    return proc, wait_for("the fake server to listen", url, 30)


def _prometheus(stack: contextlib.ExitStack, tmp: Path, binary: str, metrics_port: int) -> str:
    """The shipped prometheus.yml with a 1 s scrape of the test's hsx and the shipped
    rules, on 127.0.0.1, its TSDB in the test's temp dir; its base URL once ready."""
    cfg = yaml.safe_load(PROM_CONFIG.read_text())
    cfg["global"] = {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": "1s"}
    cfg["rule_files"] = [str(RULES)]
    [job] = cfg["scrape_configs"]
    job["static_configs"][0]["targets"] = [f"127.0.0.1:{metrics_port}"]
    config = tmp / "prometheus.yml"
    config.write_text(yaml.safe_dump(cfg))
    port = free_port()
    argv = [
        binary, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn",
    ]  # fmt: skip
    stack.enter_context(process(argv, tmp / "prometheus.log"))
    base = f"http://127.0.0.1:{port}"
    wait_for("Prometheus to be ready", lambda: http_get(f"{base}/-/ready") or None, 30)
    return base


@pytest.fixture
def live(tmp_path: Path, shm_root: Path) -> Iterator[Live]:
    tools = require_tools("prometheus", "promtool")
    with contextlib.ExitStack() as stack:  # closed in reverse: Prometheus, hsx, server
        server, url = _fake_server(stack, tmp_path, shm_root)
        # ~2,000 samples at ~20 a second: the run outlasts the checks; it is stopped after.
        # One line in 40 is bad (quarantined), 5% of requests get an HTTP 500 (retried).
        samples = write_samples(tmp_path / "in.jsonl", 2000, max_len=24, bad_every=40)
        metrics_port = free_port()
        raw = config_raw(
            tmp_path,
            samples.path,
            [url],
            shm_root,
            workers={"concurrency": 2, "max_attempts": 3},
            daemon={
                "drain_timeout": 10.0,
                "metrics_listen": f"127.0.0.1:{metrics_port}",
                "log_format": "json",
            },
        )
        raw["server"]["health_interval"] = 0.2
        # The online mode's series (spool, per consumer) exist only with a spool: a
        # registered consumer that acknowledges nothing, and a limit the run never reaches.
        raw["output"].update(retention="acked", consumers=["trainer"], spool_limit="4GiB")
        config = write_config(tmp_path, raw)
        hsx_argv = [sys.executable, "-m", "hsx_async", "run", "--config", str(config)]
        hsx = stack.enter_context(process(hsx_argv, tmp_path / "hsx.log"))
        base = _prometheus(stack, tmp_path, tools["prometheus"], metrics_port)
        yield Live(base, hsx, server, tmp_path)


def _alerts(live: Live) -> dict[str, str]:
    """Active alerts: name → state (pending, firing)."""
    return {a["labels"]["alertname"]: a["state"] for a in live.api("alerts")["alerts"]}


def _every_series_has_data(live: Live, names: list[str]) -> bool | None:
    ok = all(live.query(f'count({{__name__="{n}", job="hsx"}})') for n in names)
    both = {r["metric"]["outcome"] for r in live.query('hsx_samples_total{job="hsx"}')}
    # rate() needs two scrapes of a series, histogram_quantile a few: wait ~8 scrapes.
    rated = live.query('count_over_time(hsx_samples_total{outcome="quarantined"}[1m]) >= 8')
    return True if ok and both == {"done", "quarantined"} and rated else None


@pytest.mark.timeout(240)
def test_live_prometheus_sees_every_metric_dashboard_query_and_rule(live: Live) -> None:
    names = sorted(set(_exposed_series()) - ON_EVICTION)
    wait_for("every hsx series in Prometheus", lambda: _every_series_has_data(live, names), 90)
    assert live.hsx.poll() is None, "hsx ended before the checks: give it more samples"
    # Each dashboard query returns data while the run is going (those on evictions: below).
    queries = _targets(_dashboard())
    on_eviction = [(title, expr) for title, expr in queries if _hsx_names(expr) & ON_EVICTION]
    empty = [(t, e) for t, e in queries if (t, e) not in on_eviction and not live.query(e)]
    assert not empty, f"dashboard queries without data: {empty}"
    assert on_eviction, "the dashboard has no panel on servers leaving rotation"
    target = live.api("targets")["activeTargets"]
    assert [t["health"] for t in target if t["labels"]["job"] == "hsx"] == ["up"]
    # Every alert rule is loaded and evaluates without error against live data.
    rules = [r for g in live.api("rules")["groups"] for r in g["rules"]]
    assert {r["name"] for r in rules} == {
        r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]
    }
    assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]
    # One sample in 40 is quarantined (> 1%): that alert goes pending; none of those about
    # a stopped run does. (HsxDiskNearReserve is left out: it extrapolates free space,
    # which other work on this machine moves.)
    wait_for(
        "HsxQuarantineRateHigh to go pending",
        lambda: "HsxQuarantineRateHigh" in _alerts(live) or None,
        30,
    )
    healthy_run = {"HsxDown", "HsxNoProgress", "HsxServerDown", "HsxDiskUnderReserve"}
    assert not healthy_run & set(_alerts(live)), _alerts(live)

    # The server goes away: hsx takes it out of rotation and HsxServerDown goes pending.
    stop(live.server)

    wait_for("HsxServerDown to go pending", lambda: "HsxServerDown" in _alerts(live) or None, 30)
    # ... the eviction is counted, with its fault kind, and the dashboard's panels show it.
    out = wait_for(
        "the eviction in Prometheus",
        lambda: live.query('hsx_server_out_of_rotation_total{job="hsx"} >= 1') or None,
        30,
    )
    assert {r["metric"]["kind"] for r in out} <= set(KINDS), out
    empty = [(title, expr) for title, expr in on_eviction if not live.query(expr)]
    assert not empty, f"dashboard queries without data after an eviction: {empty}"
    os.kill(live.hsx.pid, signal.SIGTERM)
    assert live.hsx.wait(60) == 0, (live.tmp / "hsx.log").read_text()[-3000:]
