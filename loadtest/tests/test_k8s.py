"""The in-cluster locust manifests ship the repo's own modules and its pins."""
import ast
import re
from pathlib import Path

import yaml

LOADTEST = Path(__file__).resolve().parents[1]
K8S = LOADTEST / "k8s"
REQUIREMENTS = (LOADTEST.parent / "requirements.txt").read_text()


def loadtest_imports(module: str) -> set[str]:
    """Modules of the loadtest package that `module` imports, transitively."""
    seen, todo = set(), [module]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        tree = ast.parse((LOADTEST / f"{name}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("loadtest."):
                todo.append(node.module.split(".")[1])
            elif isinstance(node, ast.ImportFrom) and node.module == "loadtest":
                todo.extend(alias.name for alias in node.names)
    return seen


def data_files(module: str) -> set[str]:
    """Files a module reads next to itself: Path(__file__).with_name("...")."""
    text = (LOADTEST / f"{module}.py").read_text()
    return set(re.findall(r'with_name\("([^"]+)"\)', text))


def test_configmap_lists_the_locustfile_and_everything_it_imports():
    modules = loadtest_imports("locustfile")
    needed = {f"{m}.py" for m in modules} | {"__init__.py"}
    needed |= {name for m in modules for name in data_files(m)}
    kust = yaml.safe_load((LOADTEST / "kustomization.yaml").read_text())
    code = next(g for g in kust["configMapGenerator"] if g["name"] == "locust-code")
    assert set(code["files"]) == needed


def test_images_and_pip_pins_match_requirements():
    locust = re.search(r"^locust==(\S+)", REQUIREMENTS, re.M).group(1)
    numpy = re.search(r"^numpy==(\S+)", REQUIREMENTS, re.M).group(1)
    for name in ("master.yaml", "worker.yaml"):
        text = (K8S / name).read_text()
        images = set(re.findall(r"image:\s*(\S+)", text))
        assert images == {f"locustio/locust:{locust}"}, name
        assert f"numpy=={numpy}" in text, name
