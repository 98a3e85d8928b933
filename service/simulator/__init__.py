"""The LLM simulator (DESIGN §8b): OpenAI-compatible fake models for demos, drills, tests and benchmarks.

    from service.simulator.config import load_simulator_config
    from service.simulator.server import serve, start_in_thread
"""
