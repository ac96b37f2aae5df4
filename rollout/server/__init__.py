"""The engine server: SGLang's native HTTP API and OpenAI's routes around any `RolloutEngine`, and `engine-serve`."""
