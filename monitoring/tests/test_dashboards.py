"""The generated dashboards: committed files up to date, ConfigMaps for the sidecar, panels documented."""
from __future__ import annotations

import json
import subprocess

from monitoring import dashboards

ROOT = dashboards.REPO


def test_committed_dashboards_equal_the_generator_output():
    for make in dashboards.DASHBOARDS:
        d = make()
        path = dashboards.OUT / f"{d.uid}.json"
        assert path.read_text() == dashboards.render(d), f"{path} is stale: run python -m monitoring.dashboards"


def test_check_mode_reports_a_stale_file(tmp_path, capsys):
    assert dashboards.main(["--out", str(tmp_path)]) == 0
    path = tmp_path / "inference-routing.json"
    doc = json.loads(path.read_text())
    doc["panels"][1]["targets"][0]["expr"] = "up"
    path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    assert dashboards.main(["--check", "--out", str(tmp_path)]) == 1
    assert "inference-routing.json" in capsys.readouterr().err


def test_dashboards_ship_as_sidecar_configmaps():
    out = subprocess.run(["kubectl", "kustomize", str(ROOT / "overlays/a10-monitoring")],
                         capture_output=True, text=True, check=True).stdout
    import yaml
    maps = {o["metadata"]["name"]: o for o in yaml.safe_load_all(out)
            if o and o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("grafana-dashboard-")}
    assert set(maps) == {"grafana-dashboard-inference-pool", "grafana-dashboard-inference-routing"}
    for cm in maps.values():
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        (name, text), = cm["data"].items()
        assert json.loads(text)["uid"] == name.removesuffix(".json")


def test_every_panel_has_a_description_and_queries():
    for make in dashboards.DASHBOARDS:
        doc = dashboards.build(make())
        panels = [p for p in doc["panels"] if p["type"] != "row"]
        assert panels
        for p in panels:
            assert p.get("description") and p.get("targets"), p["title"]
            assert all(t["expr"] and t["datasource"]["uid"] == "${datasource}" for t in p["targets"])
