"""Schedule settings: exactly one of cron and interval, and a cron Prefect would refuse is a config error."""

import os

import pytest
from pydantic import ValidationError

from flows.schedule import check_schedule
from tasks.config import ScheduleConfig
from tasks.errors import ConfigError
from tasks.params import Config


def test_an_interval_replaces_the_nightly_cron_only_when_cron_is_cleared():
    assert ScheduleConfig().when == {"cron": "0 3 * * *"}
    assert ScheduleConfig(cron=None, interval_s=60).when == {"interval": 60}
    with pytest.raises(ValidationError, match="exactly one of cron and interval_s"):
        ScheduleConfig(interval_s=60)


def test_a_cron_prefect_would_refuse_is_named_before_anything_starts():
    config = Config(variants={"baseline": {}}, schedule={"cron": "61 * * * *"})
    with pytest.raises(
        ConfigError, match="schedule.cron: '61 \\* \\* \\* \\*' is not a valid cron expression"
    ):
        check_schedule(config)
    check_schedule(Config(variants={"baseline": {}}))


def test_the_tracking_stack_starts_its_database_and_store_before_the_servers_on_the_configured_ports(
    tmp_path,
):
    from flows.services import configured_services

    plain = configured_services(Config(variants={"baseline": {}}), tmp_path)
    assert [service.name for service in plain] == ["prefect-server"]
    config = Config(variants={"baseline": {}}, services={"tracking_stack": True, "postgres_port": 6001})
    stack = configured_services(config, tmp_path)
    assert [service.name for service in stack] == ["postgres", "s3", "mlflow-server", "prefect-server"]
    assert stack[0].health_url == "tcp://127.0.0.1:6001" and stack[0].env["PGDATA"].endswith(
        "services/postgres"
    )
    assert all(service.script.is_file() and os.access(service.script, os.X_OK) for service in stack)
