"""Process isolation shared by reward recipes and multi-turn tools/environments: the code
sandbox (bubblewrap), worker calls with timeouts, and the step budget of those calls."""
