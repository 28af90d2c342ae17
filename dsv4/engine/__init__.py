"""The engine: `EngineCore` (schedule -> execute -> update on one thread), `AsyncEngine` (that core
bridged to asyncio for the services) and offline batch generation."""
