"""Configuration: CLI flag over environment over default; invalid values name the variable and the allowed values."""

import argparse
import socket

import pytest

from openengine_serve.common import config as cfg

from ..conftest import REPO


def parse(config_cls, argv):
    parser = argparse.ArgumentParser()
    cfg.add_arguments(parser, config_cls)
    return parser.parse_args(argv)


def test_flag_over_environment_over_default():
    env = {"OPENENGINE_PORT": "6000", "OPENENGINE_MAX_BATCH": "8"}
    node = cfg.load(cfg.NodeConfig, parse(cfg.NodeConfig, ["--max-batch", "4"]), env)
    assert (node.port, node.max_batch, node.step_ms) == (6000, 4, 2.0)


def test_frontend_workers_variable_name():
    assert cfg.load(cfg.FrontendConfig, None, {"OPENENGINE_FRONTEND_WORKERS": "3"}).workers == 3


@pytest.mark.parametrize(
    "env,needle",
    [
        ({"OPENENGINE_GRPC_SERVER": "tornado"}, "OPENENGINE_GRPC_SERVER must be one of grpcio, pygrpc-native"),
        ({"OPENENGINE_PORT": "abc"}, "OPENENGINE_PORT must be an integer"),
        ({"OPENENGINE_PORT": "70000"}, "OPENENGINE_PORT must be between 1 and 65535"),
        ({"OPENENGINE_DRAIN_TIMEOUT_S": "-1"}, "OPENENGINE_DRAIN_TIMEOUT_S must be >= 0"),
        ({"OPENENGINE_DRAIN_TIMEOUT_S": "nan"}, "OPENENGINE_DRAIN_TIMEOUT_S must be a number"),
        ({"OPENENGINE_FRONTEND_WORKERS": "0"}, "OPENENGINE_FRONTEND_WORKERS must be between 1 and 64"),
        ({"OPENENGINE_NATIVE_IO_THREADS": "-1"}, "OPENENGINE_NATIVE_IO_THREADS must be between 0 and 64"),
        ({"OPENENGINE_MAX_CONNECTION_AGE_S": "-5"}, "OPENENGINE_MAX_CONNECTION_AGE_S must be >= 0"),
        ({"OPENENGINE_COORDINATOR_ADDRESS": "c0:50052,,c1:50052"}, "without empty entries; got 'c0:50052,,c1:50052'"),
        ({"OPENENGINE_COORDINATOR_ADDRESS": "c0:1, c1:1,c0:1"}, "lists c0:1 more than once"),
    ],
)
def test_invalid_values_name_the_variable(env, needle):
    with pytest.raises(cfg.ConfigError, match=needle.replace("(", r"\(")):
        cfg.load(cfg.FrontendConfig, None, env)


def test_invalid_flag_names_the_flag():
    with pytest.raises(cfg.ConfigError, match="--max-batch must be >= 0"):
        cfg.load(cfg.NodeConfig, parse(cfg.NodeConfig, ["--max-batch", "-1"]), {})


def test_max_batch_zero_is_the_engines_default():
    assert cfg.load(cfg.NodeConfig, None, {}).max_batch == 32  # llama.cpp, the default engine
    assert cfg.load(cfg.NodeConfig, None, {"OPENENGINE_ENGINE": "simulated"}).max_batch == 256
    assert (
        cfg.load(cfg.NodeConfig, None, {"OPENENGINE_ENGINE": "simulated", "OPENENGINE_MAX_BATCH": "8"}).max_batch == 8
    )


def test_llama_cpp_settings_are_checked_against_the_engine():
    with pytest.raises(cfg.ConfigError, match="OPENENGINE_ENGINE_RANKS must be 1 with the llama.cpp engine"):
        cfg.load(cfg.NodeConfig, None, {"OPENENGINE_ENGINE_RANKS": "2"})
    with pytest.raises(cfg.ConfigError, match="OPENENGINE_MAX_BATCH must be at most 256"):
        cfg.load(cfg.NodeConfig, None, {"OPENENGINE_MAX_BATCH": "300"})
    with pytest.raises(cfg.ConfigError, match="OPENENGINE_ENGINE must be one of llama.cpp, simulated"):
        cfg.load(cfg.NodeConfig, None, {"OPENENGINE_ENGINE": "vllm"})


def test_a_comma_separated_coordinator_address_lists_the_coordinators():
    assert cfg.FrontendConfig().coordinators() == ("127.0.0.1:50052",)
    node = cfg.load(cfg.NodeConfig, None, {"OPENENGINE_COORDINATOR_ADDRESS": "c0:50052, c1:50052"})
    assert node.coordinators() == ("c0:50052", "c1:50052")
    with pytest.raises(cfg.ConfigError, match="OPENENGINE_COORDINATOR_ADDRESS must be host:port"):
        cfg.load(cfg.NodeConfig, None, {"OPENENGINE_COORDINATOR_ADDRESS": ""})


def test_readme_documents_every_knob():
    readme = (REPO / "README.md").read_text()
    assert cfg.markdown_table() in readme, "regenerate the table: python -m openengine_serve.common.config"


def test_advertise_address_defaults():
    assert cfg.NodeConfig(host="127.0.0.1", port=7000).resolved_advertise_address() == "127.0.0.1:7000"
    assert cfg.NodeConfig(advertise_address="n1:1").resolved_advertise_address() == "n1:1"
    assert cfg.NodeConfig(host="0.0.0.0", port=7000).resolved_advertise_address() == f"{socket.gethostname()}:7000"
    assert cfg.FrontendConfig(host="::").reachable_host() == socket.gethostname()
    assert cfg.FrontendConfig(host="10.0.0.5").reachable_host() == "10.0.0.5"


def test_max_connection_age_on_both_servers():
    assert cfg.load(cfg.FrontendConfig, None, {"OPENENGINE_MAX_CONNECTION_AGE_S": "60"}).max_connection_age_s == 60
    native = cfg.load(
        cfg.FrontendConfig, None, {"OPENENGINE_MAX_CONNECTION_AGE_S": "60", "OPENENGINE_GRPC_SERVER": "pygrpc-native"}
    )
    assert (native.grpc_server, native.max_connection_age_s) == ("pygrpc-native", 60)
