"""Ready configurations for coding assistants, and the code that writes them (`agentfold integrate`)."""
