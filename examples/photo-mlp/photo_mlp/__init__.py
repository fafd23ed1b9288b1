"""photo_mlp: a small Flower app (an MLP on 32x32 photos) whose server is audited by fl-attack."""
