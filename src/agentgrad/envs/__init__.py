from agentgrad.envs.base import (
                                 SUITES,
                                 ActionMask,
                                 Env,
                                 EnvCheckError,
                                 SuiteCheckError,
                                 TaskSuite,
                                 check_env,
                                 check_suite,
                                 close_env,
                                 close_suite,
                                 episode_success,
                                 make_suite,
)

# Importing a suite registers it in SUITES.
from agentgrad.envs.tasks import api_catalog as _api_catalog  # noqa: F401
from agentgrad.envs.tasks import arithmetic as _arithmetic  # noqa: F401
from agentgrad.envs.tasks import code as _code  # noqa: F401
from agentgrad.envs.tasks import jsonl as _jsonl  # noqa: F401
from agentgrad.envs.tasks import multi_tool as _multi_tool  # noqa: F401
from agentgrad.envs.tasks import search_qa as _search_qa  # noqa: F401
from agentgrad.envs.tasks import sql_qa as _sql_qa  # noqa: F401
from agentgrad.envs.tool_env import ToolEnv

__all__ = ["SUITES", "ActionMask", "Env", "EnvCheckError", "SuiteCheckError", "TaskSuite", "ToolEnv", "check_env",
           "check_suite", "close_env", "close_suite", "episode_success", "make_suite"]
