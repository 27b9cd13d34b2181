"""Validate ``deploy/kubernetes/`` against the Kubernetes JSON schemas (CI and tests).

Every resource the kustomization lists, the resources and patches of the optional
components in its subfolders (``retention/``), and ``secret.example.yaml``, is checked with
kubernetes-validate (its schemas ship inside the package: nothing is fetched) in strict
mode (an unknown field is an error, so a misspelt key never passes) against the oldest
and the newest Kubernetes version we support.

Usage: ``python scripts/validate_kubernetes.py``; exit 0 when every document is valid.
"""

from __future__ import annotations

import sys
from pathlib import Path

import kubernetes_validate
import yaml

ROOT = Path(__file__).resolve().parent.parent
MANIFESTS = ROOT / "deploy" / "kubernetes"
#: Native gRPC probes are GA from 1.27; 1.28 is the oldest release we claim.
VERSIONS = ("1.28.0", "1.37.0")


def manifest_files() -> list[Path]:
    """The kustomization's resources, the optional components' resources and patches,
    then the example Secret."""
    kustomization = yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())
    files = [MANIFESTS / name for name in kustomization["resources"]]
    for folder in component_folders():
        component = yaml.safe_load((folder / "kustomization.yaml").read_text())
        files += [folder / name for name in component.get("resources", [])]
        files += [folder / patch["path"] for patch in component.get("patches", [])]
    return [*files, MANIFESTS / "secret.example.yaml"]


def component_folders() -> list[Path]:
    """The subfolders holding a kustomize Component (optional parts an overlay adds)."""
    return sorted(
        path.parent
        for path in MANIFESTS.glob("*/kustomization.yaml")
        if yaml.safe_load(path.read_text()).get("kind") == "Component"
    )


def problems() -> list[str]:
    """One line per document that is not valid (or not a resource) for a version."""
    found: list[str] = []
    for path in manifest_files():
        documents = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        if not documents:
            found.append(f"{path.name}: no resource")
        for document in documents:
            for version in VERSIONS:
                try:
                    kubernetes_validate.validate(document, version, strict=True)
                except kubernetes_validate.ValidationError as error:
                    where = "/".join(str(p) for p in error.path)
                    found.append(f"{path.name} ({version}): {where}: {error.message}")
                except kubernetes_validate.SchemaNotFoundError as error:
                    found.append(f"{path.name} ({version}): {error}")
    return found


def main() -> int:
    found = problems()
    for line in found:
        print(line)
    if not found:
        names = ", ".join(str(path.relative_to(MANIFESTS)) for path in manifest_files())
        print(f"valid against Kubernetes {' and '.join(VERSIONS)}: {names}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
