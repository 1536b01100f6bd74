"""scratchlm: a complete LLM stack written from scratch on PyTorch tensors."""

__version__ = "0.1.0"

#: The executor ("module:attribute") that runs an engine over several processes (tensor x pipeline x
#: context parallel size > 1). It is named here, in the package above both, so that `inference/` (which
#: knows only the `scratchlm.inference.executor.Executor` interface) never imports `parallel/` (which
#: provides this class, and imports `inference/`).
MULTIPROCESS_EXECUTOR = "scratchlm.parallel.launch:MultiprocExecutor"
