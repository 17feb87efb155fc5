"""hivetrain: decentralized volunteer training (DiLoCo over a hivemind DHT).

Importing this package has no side effects; see README.md for the architecture.
"""

__version__ = "0.1.0"
