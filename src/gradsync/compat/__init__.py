"""Other tools' files and flags in gradsync's terms, without torch.

``files`` reads config files (the one YAML/JSON reader) and DeepSpeed configs (the one
loader); ``accelerate`` translates Accelerate's config file and ``accelerate launch``'s flags.
The core (``gradsync.config``, the DeepSpeed backend) and the launcher both import this
package; it imports neither of them, and no torch.
"""
