from agentgrad.envs.base import SUITES, ActionMask, Env, EnvCheckError, TaskSuite, check_env
from agentgrad.envs.tool_env import ToolEnv
from agentgrad.envs.tasks import arithmetic as _arithmetic  # noqa: F401  (registers the suite)

__all__ = ["SUITES", "ActionMask", "Env", "EnvCheckError", "TaskSuite", "ToolEnv", "check_env"]
