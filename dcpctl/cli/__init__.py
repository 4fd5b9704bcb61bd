"""Click commands: parse the arguments, call an operation, render its report."""
