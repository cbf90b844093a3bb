"""Pytest fixtures for a real Kubernetes v1.20 control plane on loopback.

Registered for the whole suite by `pytest_plugins` in tests/conftest.py.
The binaries come from `make control-plane` (`make test` runs it first); a
missing build fails the test with that instruction instead of building
inside a test's time budget.

Fixtures:

- ``control_plane`` (session): a started `ControlPlane` with
  ``--authorization-mode=AlwaysAllow``. Attributes: ``kubeconfig_path``,
  ``server_url``, ``admin_token``, ``ca_path``; methods ``api()``,
  ``service_account_token()``, ``service_account_kubeconfig()``,
  ``kubeconfig_for_token()``, ``ensure_namespace()``, ``env()``.
  Shared by the session: tests should work in their own namespace
  (``k8s_namespace``) and clean up cluster-scoped objects they create.
- ``kubeconfig`` (session): the admin kubeconfig ``Path`` of ``control_plane``.
- ``kubectl`` (session): ``kubectl("get", "ns", "-o", "json")`` runs the cached
  kubectl against ``control_plane`` and returns the ``CompletedProcess``
  (text); it raises ``KubectlError`` with stderr on a non-zero exit unless
  ``check=False``. ``input=`` feeds stdin (``kubectl("apply", "-f", "-",
  input=yaml)``); ``kubeconfig=`` runs as someone else.
- ``helm`` (session): the same for the cached helm (v4).
- ``k8s_namespace`` (function): a fresh namespace in ``control_plane``,
  deleted afterwards.
- ``rbac_control_plane`` (module): a separate plane with
  ``--authorization-mode=RBAC``. The admin token is in ``system:masters``;
  use ``rbac_control_plane.service_account_kubeconfig(ns, name)`` to act as a
  ServiceAccount bound only to the roles under test. Use its own
  ``Kubectl(rbac_control_plane.kubeconfig_path)`` for kubectl.
- ``start_control_plane`` (function): a factory,
  ``start_control_plane(authorization_mode="RBAC")``, for a private plane
  per test (e.g. to restart things); every plane it made is stopped after the
  test.

All planes are stopped (SIGTERM, then SIGKILL) in teardown, also when the
test fails, and their temp dirs removed (``SPECPAIR_KEEP_CONTROL_PLANE_DIR=1``
keeps them, with the three logs, for debugging).
"""

from __future__ import annotations

import contextlib
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from tools.control_plane import (
    Binaries,
    ControlPlane,
    default_cache_dir,
    is_built,
)


class KubectlError(AssertionError):
    """kubectl or helm exited non-zero; the message holds the command and stderr."""


class Kubectl:
    """Runs a cached client binary (kubectl or helm) with a fixed kubeconfig."""

    def __init__(
        self, kubeconfig: Path, binary: Path | None = None, timeout_s: float = 120.0
    ) -> None:
        self.kubeconfig = kubeconfig
        self.binary = binary or Binaries.under(default_cache_dir()).kubectl
        self.timeout_s = timeout_s

    def __call__(
        self,
        *args: str,
        input: str | None = None,
        check: bool = True,
        kubeconfig: Path | None = None,
    ) -> subprocess.CompletedProcess[str]:
        argv = [str(self.binary), "--kubeconfig", str(kubeconfig or self.kubeconfig), *args]
        done = subprocess.run(
            argv,
            input=input,
            capture_output=True,
            text=True,
            check=False,
            timeout=self.timeout_s,
        )
        if check and done.returncode != 0:
            raise KubectlError(
                f"`{' '.join(argv[0:1] + list(args))}` exited {done.returncode}:\n{done.stderr}"
            )
        return done


def _require_binaries() -> Binaries:
    cache = default_cache_dir()
    binaries = Binaries.under(cache)
    if not is_built(cache):
        pytest.fail(
            f"the control plane binaries are not built under {cache} "
            f"(missing: {', '.join(binaries.missing()) or 'completion marker'}); "
            "run `make control-plane` (make test does it first)",
            pytrace=False,
        )
    return binaries


@pytest.fixture(scope="session")
def control_plane_binaries() -> Binaries:
    """The cached binaries; fails with an instruction when they are not built."""
    return _require_binaries()


@pytest.fixture(scope="session")
def control_plane(control_plane_binaries: Binaries) -> Iterator[ControlPlane]:
    """A session-wide control plane with AlwaysAllow authorization."""
    plane = ControlPlane(control_plane_binaries, authorization_mode="AlwaysAllow")
    try:
        plane.start()
        yield plane
    finally:
        plane.stop()


@pytest.fixture(scope="session")
def kubeconfig(control_plane: ControlPlane) -> Path:
    return control_plane.kubeconfig_path


@pytest.fixture(scope="session")
def kubectl(control_plane: ControlPlane, control_plane_binaries: Binaries) -> Kubectl:
    return Kubectl(control_plane.kubeconfig_path, control_plane_binaries.kubectl)


@pytest.fixture(scope="session")
def helm(control_plane: ControlPlane, control_plane_binaries: Binaries) -> Kubectl:
    return Kubectl(control_plane.kubeconfig_path, control_plane_binaries.helm, timeout_s=300.0)


@pytest.fixture
def k8s_namespace(control_plane: ControlPlane) -> Iterator[str]:
    """A fresh namespace, deleted (asynchronously) after the test."""
    name = f"t-{uuid.uuid4().hex[:10]}"
    control_plane.ensure_namespace(name)
    try:
        yield name
    finally:
        if control_plane.running():
            with contextlib.suppress(OSError):
                control_plane.api("DELETE", f"/api/v1/namespaces/{name}")


@pytest.fixture(scope="module")
def rbac_control_plane(control_plane_binaries: Binaries) -> Iterator[ControlPlane]:
    """A control plane with RBAC authorization, shared by one test module."""
    plane = ControlPlane(control_plane_binaries, authorization_mode="RBAC")
    try:
        plane.start()
        yield plane
    finally:
        plane.stop()


@pytest.fixture
def start_control_plane(
    control_plane_binaries: Binaries,
) -> Iterator[Callable[..., ControlPlane]]:
    """A factory for private planes; all are stopped after the test."""
    planes: list[ControlPlane] = []

    def start(authorization_mode: str = "AlwaysAllow") -> ControlPlane:
        plane = ControlPlane(control_plane_binaries, authorization_mode=authorization_mode)
        planes.append(plane)
        return plane.start()

    try:
        yield start
    finally:
        for plane in planes:
            plane.stop()
