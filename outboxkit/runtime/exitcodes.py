"""Process exit codes, distinct per cause so an orchestrator can tell them apart."""

EXIT_OK = 0  # clean drain
EXIT_FAILURE = 1  # unexpected error (a bug); drain was attempted
EXIT_CONFIG = 2  # bad settings / bad CLI input (message names the setting)
EXIT_DEPENDENCY = 3  # a dependency unreachable at start, or gone for good
EXIT_FORCED = 4  # shutdown_timeout passed: forced exit, cut resources logged
