"""What two commands share: the text they run on (data: sentences, passages, a held-out batch; ioi: IOI prompt
pairs and their score)."""
