"""Third-party integrations, one module or package per library, each the only place that imports
it (none is imported here: ``import diskreplay`` loads none of these libraries):

* `sb3` - Stable-Baselines3's replay buffers on a diskreplay buffer (``dr.sb3``; imports
  stable_baselines3 and gymnasium; `diskreplay.sb3` keeps its former import paths);
* `torchrl` - ``dr.torchrl.ZarrStorage``, a TorchRL storage (imports torchrl and tensordict);
* `gymnasium` - a buffer's fields from gymnasium spaces and envs (``dr.fields_from_spaces``...;
  imports gymnasium only when called).

Sits above the torch layer and the importers (whose field names `gymnasium` uses).
"""
