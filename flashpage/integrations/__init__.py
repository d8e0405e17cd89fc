"""Integrations with training libraries (optional peers, imported only when used).

- :mod:`flashpage.integrations.trl`: flashpage as TRL ``GRPOTrainer``'s generation backend
  (``pip install 'flashpage[rl]'``).
"""
