"""The Ansible roles claim only the platforms a real deploy ran on. CI's deploy
(tests/deploy/test_ansible.py: a real ansible-playbook run of both roles) runs on this
machine, so its OS must be one of them; add another to DEPLOYED_ON, and to the roles'
metadata, once that deploy has passed there."""

from __future__ import annotations

from pathlib import Path

import yaml

ROLES = Path(__file__).parents[2] / "ansible" / "roles"
DEPLOYED_ON = {("Debian", "bookworm")}


def claimed(role: str) -> set[tuple[str, str]]:
    meta = yaml.safe_load((ROLES / role / "meta" / "main.yml").read_text())
    return {(platform["name"], version) for platform in meta["galaxy_info"]["platforms"]
            for version in platform["versions"]}


def test_the_roles_claim_only_where_a_deploy_ran() -> None:
    for role in ("etcd", "lumend"):
        assert claimed(role) == DEPLOYED_ON, role


def test_the_deploy_test_runs_on_a_claimed_platform() -> None:
    fields = dict(line.split("=", 1) for line in
                  Path("/etc/os-release").read_text().splitlines() if "=" in line)
    here = (fields.get("NAME", "").strip('"').split()[0], fields.get("VERSION_CODENAME", ""))
    assert here in DEPLOYED_ON, (
        f"the deploy test runs on {here}, which the roles do not claim: once "
        "tests/deploy/test_ansible.py passes here, add it to DEPLOYED_ON and the roles' meta")
