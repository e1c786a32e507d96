"""The reference rollout receiver, `dcs receiver`: its HTTP app (SGLang's weight-update endpoints, `server`), the
auth and size guard around it (`guard`) and its command line (`cli`). The in-process `WeightReceiver` it serves
is `dcs_tasks.sync.receiving`."""
